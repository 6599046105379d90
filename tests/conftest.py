import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import pytest  # noqa: E402
import torch  # noqa: E402

# Triton kernels run on CPU only under the interpreter, which must be chosen before triton is imported
# (torch does not import it eagerly); with CUDA the same tests run compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from draftheads.testing import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_target(tiny_llama_dir):
    from draftheads.targets import load_target

    return load_target(str(tiny_llama_dir))


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch, request):
    """Keep unit tests away from the user's cache; integration tests may share it."""
    if "integration" not in request.keywords:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


# Lightning gives its logger a StreamHandler on the sys.stderr of the moment it is imported. Imported
# inside a test, that is the test's captured stream, closed afterwards, and every later test that logs
# through Lightning prints "Logging error" tracebacks: import it here, under the session's capture.
import lightning.pytorch  # noqa: E402, F401


@pytest.fixture(autouse=True)
def _no_stale_log_handlers():
    """A CLI called in a test binds logging.basicConfig's handler to that test's captured stderr, which
    is closed afterwards: drop handlers a test added, so later tests do not log into a closed stream."""
    import logging

    root = logging.getLogger()
    before = list(root.handlers)
    yield
    for h in root.handlers[:]:
        if h not in before:
            root.removeHandler(h)

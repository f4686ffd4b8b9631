from lck_runtime.pytest_plugin import (  # noqa: F401
    _cpu_tests_hide_cuda,
    pytest_collection_modifyitems,
    pytest_configure,
)

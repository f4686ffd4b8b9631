from lck_runtime.pytest_plugin import (  # noqa: F401
    _mark_cpu_tests,
    pytest_collection_modifyitems,
    pytest_configure,
)

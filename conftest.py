pytest_plugins = ["conformance.pytest_plugin"]

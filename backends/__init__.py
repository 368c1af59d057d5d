"""Backends: the adapter contract, the registry, and one module or package per implementation."""

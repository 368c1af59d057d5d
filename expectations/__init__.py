"""The expectation manifests, one ``<backend>.toml`` per backend (a package so that an
installed wheel carries them: ``conformance.manifest`` finds them through this module)."""

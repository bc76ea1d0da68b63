"""The test suite, one package, so its folders (kernels, server, models, ...) never shadow
installed distributions of the same names (transformers imports `kernels`)."""

"""Pallas kernels, each in its own folder beside its pure-jnp reference, input validation and
benchmark: `paged_attention` (paged decode attention, GQA and absorbed MLA, bf16/fp8 pages) and
`int4_matmul` (W4A16 dense and ragged-by-expert matmuls). GPU backend: Pallas Triton."""

"""C code of the engine, built once per machine: the build and its disk cache (:mod:`.build`), the
sampler's kernels behind one header and typed wrappers (:mod:`.kernels`, ``kernels.h``), and the
program that times libgomp's spin loop (``spin.c``, run by the runtime's OpenMP tuning). Below both
the sampling layer and the runtime; imports nothing of sess outside it."""

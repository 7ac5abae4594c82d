"""C++ CPU ops of the sampler (``row_argmax.cpp``), built on first use as the attention
backends' ops are (``tandem.backends.cpp_build``)."""

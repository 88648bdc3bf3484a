"""Models: building Hugging Face models, precision and compile, the optimizer and schedule."""

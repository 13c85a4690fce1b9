"""offload-tuner's runtime: engines that execute plans (sim, torch, llama.cpp) and the synthetic GGUF writer."""

"""offload-tuner's core: the model inventory (GGUF files and presets), hardware, workloads, memory and cost models,
placements and their llama.cpp flags, and the engine protocol with its registry. It imports none of tuner/,
runtime/ or offload_tuner/, and never torch (tests/test_import_graph.py)."""

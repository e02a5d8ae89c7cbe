"""GGUF files (llama.cpp's format): reading, mapping to Hugging Face models, serving natively."""

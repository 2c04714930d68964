"""The model: every served family over one Llama-shaped layout, GGUF and Hugging Face
loaders, weight formats (fp32, bf16, int8, int4, native, native-a8) and the native step."""

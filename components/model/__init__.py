"""The model library (not a process): model files and what is read from them. Fetching the
default model, the GGUF header, KV sizing by the model's shape, the vocabulary, chat
templates, prompt rendering and prefix block hashing, and structured-output grammars.
The tokenizer, detokenizer, executor, router and gateway processes share it."""

"""Pure helpers every layer shares: the typed server/request contexts, OpenAI-shaped errors, the packaged chat
templates, Qwen model-family detection. Imports no capability and no vLLM."""

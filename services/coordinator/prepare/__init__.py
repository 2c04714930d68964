"""From a validated request body to tokenized generation requests: the body schemas, the
chat template, tools and response formats, token limits and the context window."""

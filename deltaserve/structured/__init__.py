"""Structured outputs: what a request's text must match (JSON schema, regex, choice, grammar, tool
calls), compiled by xgrammar into token masks the engine's sampler applies."""

"""The router: OpenAI endpoint, instance registry, modality-aware routing, trace, SLO metrics."""

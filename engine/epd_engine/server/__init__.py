"""The instance app: OpenAI API, health, metrics and (for disaggregation) internal endpoints."""

"""The OpenAI surface the instance app and the router app share: request/response shapes,
streaming chunks, logprobs, validation, limits, internal-token auth and the error mapping."""

"""The Kubernetes backend: kopf handlers, the reconcile pass, the API-server client, manifests,
guardrails, pod health, errors a retry cannot fix, the operator's metrics and settings."""

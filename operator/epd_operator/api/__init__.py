"""The EPDDeployment resource: spec and status as pydantic models (the one source of the CRD),
status conditions, and the CRD generator."""

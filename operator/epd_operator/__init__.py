"""The EPD operator: the EPDDeployment API, which plan to run, how to roll it out, and the two
backends that act (Kubernetes objects, local processes)."""

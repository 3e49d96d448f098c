"""Executes a ``SchedulerOutput`` on a device: the model runner, sampling, KV sizing, the encode
stream beside the language model, host-to-device copies. Takes only what crosses in a
``SchedulerOutput`` (an import contract checks it)."""

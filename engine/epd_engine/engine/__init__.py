"""One instance's core: ``LLMEngine`` (parts for its role, caches, scheduler, runner, budgets),
async scheduling, the engine thread's asyncio bridge, detokenizing, step phases, start-up
phases and the serving process's garbage-collector policy."""

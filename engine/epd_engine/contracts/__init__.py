"""The torch-free vocabulary the engine, router, planner and operator share: the plan and trace
contracts, client errors, the routing policy, GPU placement and the image-size rule."""

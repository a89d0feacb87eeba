"""Model code (our own nn.Modules over flattened tokens), the registry and the loaders."""

"""Driving policies over patch descriptors, and their checkpoints.

- blocks.py: what every architecture shares (the bounded head, state inputs, standardized
  descriptors, the readout layers, grid and sequence input) and `PolicySpec`, what a builder reads
- one module per architecture: grid_mlp.py ("mlp", the trainer's default), cnn.py ("cnn", the
  No-FM baseline), transformer.py ("transformer", the first, kept so its checkpoints load),
  positional_transformer.py ("positional_transformer", the transformer to train),
  patch_policy.py ("patch_policy": the kept patches of the last T frames under a block-causal
  mask) and relative_query.py ("relative_query": queries at offsets from the roi's centre, so it
  runs on a wider grid, sps_driving.core.view)
- registry.py: the one map from an architecture's name to its settings and builder; the policy
  config and `build_policy`
- checkpoint.py: saving and loading checkpoints; `DrivingPolicy`, a loaded policy
- streaming.py: `StreamingPolicy`, a loaded policy fed one camera frame at a time

Every policy that reads the kept tokens as a sequence is a `SequencePolicy` (spps, mspps); the
others read the whole grid with zeros at dropped patches.

State inputs (config "state_inputs", names from sps_driving.core.state; none when absent): the
car's speed and the cruise target speed, which the throttle depends on and no frame shows. Each is
standardized with training statistics kept as buffers (`StateStandardizer`, set by the trainer);
each architecture's module says where it reads them.

Outputs follow `sps_driving.core.topics`: steering is the front road-wheel angle in rad (left
positive), bounded to +-max_steering_rad by tanh scaling; throttle is in [-1, 1] (negative is
brake) by tanh (`BoundedHead`, shared by all). Both are finite for finite inputs.
"""

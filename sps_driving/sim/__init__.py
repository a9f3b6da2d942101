"""The closed-loop driving world (SPS section 4.2): curved roads with road actors, a kinematic
bicycle Lexus RX 450h, the scenarios of Table 1, an offscreen camera, a privileged expert, and
the commands that use them.

- config.py: config/sim.yaml and its evaluation profiles
- road.py, vehicle.py, geometry.py: centerlines and the lane frame, the vehicle model, footprint gaps
- scenarios.py: Table 1's scenarios and the actor models (training cars, unseen cars, animals)
- world.py: episodes from a seed, failure rules, the safety-driver model and the score
- expert.py: PID lane keeping with control-barrier-function obstacle terms; collection disturbances
- render.py, mesh.py: the panda3d software-rendered forward camera
- collect.py (`sps-driving collect`), evaluate.py (`sps-driving eval`), live.py (the sim_world node's
  logic), gallery.py and benchmark.py (`python -m sps_driving.sim.gallery` / `.benchmark`)
"""

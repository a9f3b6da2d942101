"""Long experiments as declared plans: `sps-driving campaign run|status PLAN.yaml` (docs/campaign.md).

A plan's steps are this project's own commands; DVC runs them (sps_driving.campaign.engine), each
step's output keyed by the content hashes of its inputs, its configuration and the code it runs."""

"""What runs inside the trainer's process: reaching the coordinator (``attach``) and the step
protocol (``step_client``)."""

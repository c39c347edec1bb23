"""Math core (torch only): rotations, quantization, calibration statistics and fitting, the artifact."""

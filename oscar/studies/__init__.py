"""Studies: scripts that produce report tables from the library (run as `python -m oscar.studies.<name>`)."""

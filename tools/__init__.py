"""Tools for users of the trainer: reports of run folders (report, sweep_report, with the t-tests of
stats) and the HellaSwag evaluation of a checkpoint. Run them from the repository root as modules:
`python -m tools.report FOLDER...`."""

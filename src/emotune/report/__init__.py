"""The run's report (report.html) and the comparison of several runs."""

"""Input readers, output writers and resume, the output schema, the summary, the progress report."""

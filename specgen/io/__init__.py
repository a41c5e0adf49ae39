"""Input readers, output writers and resume, the output schema, the summary, and the batch job."""

"""More than one engine per job: worker processes on this machine (launch.py), data-parallel jobs
(data_parallel.py), Ray Data across machines (ray_job.py)."""

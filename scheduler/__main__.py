"""``python -m scheduler``: the main job (:mod:`scheduler.entrypoints.main_job`)."""

from scheduler.entrypoints.main_job import main

if __name__ == "__main__":
    main()

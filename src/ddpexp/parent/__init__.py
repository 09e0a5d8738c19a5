"""The parent's side of one job, in the command's process: typed config, the launcher found and checked, the dry
build of the run's parts, the resume decision, plan=true, then the launcher's handle waited on."""

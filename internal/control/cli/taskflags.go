package cli

import (
	"log/slog"

	"github.com/spf13/pflag"

	"stasis/internal/control/task"
)

// envsHelp explains --envs wherever SWE-bench tasks can be loaded.
const envsHelp = "where SWE-bench instances' Python environments are built and cached, one per repository and environment_setup_commit (default ~/.cache/stasis/envs, or under $XDG_CACHE_HOME); 'host' runs their tests with the sandbox's own Python and packages, with a warning"

// addEnvsFlag adds --envs to a command that loads tasks.
func addEnvsFlag(f *pflag.FlagSet, envs *string) {
	f.StringVar(envs, "envs", "", envsHelp)
}

// taskOptions are the SWE-bench loading options of the flags.
func taskOptions(repos, envs string, log *slog.Logger) (task.SWEBenchOptions, error) {
	o, err := task.EnvsOption(envs)
	o.Repos, o.Log = repos, log
	return o, err
}

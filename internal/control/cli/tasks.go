package cli

import (
	"fmt"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"stasis/internal/control/task"
)

// tasksFlags are the flags of tasks and its subcommands.
type tasksFlags struct {
	asJSON, strict    bool
	spec, repos, envs string
}

func newTasksCmd() *cobra.Command {
	var tf tasksFlags
	cmd := &cobra.Command{
		Use:     "tasks",
		Short:   "List and inspect repository tasks (the built-in set, task directories, SWE-bench JSONL)",
		Long:    tasksLong,
		Example: tasksExample,
	}
	cmd.PersistentFlags().BoolVar(&tf.asJSON, "json", false, "print JSON instead of a table")
	cmd.PersistentFlags().StringVar(&tf.spec, "tasks", "builtin", "builtin, a task directory, or a SWE-bench JSONL file")
	cmd.PersistentFlags().StringVar(&tf.repos, "repos", "", "the directory of git clones (or bundles) a SWE-bench file refers to")
	addEnvsFlag(cmd.PersistentFlags(), &tf.envs)
	cmd.PersistentFlags().BoolVar(&tf.strict, "strict", false, "fail (exit 2) when any task fails to load, not only when none loads")
	ls := &cobra.Command{
		Use:   "ls",
		Short: "List the tasks: id, language, tests, and title",
		Args:  cobra.NoArgs,
		RunE:  tf.ls,
	}
	show := &cobra.Command{
		Use:   "show ID",
		Short: "Show one task: statement, test command, test lists, budget",
		Args:  cobra.ExactArgs(1),
		RunE:  tf.show,
	}
	cmd.AddCommand(ls, show)
	return cmd
}

// load loads the tasks, naming on stderr those that failed to load.
func (tf *tasksFlags) load(cmd *cobra.Command) ([]*task.Task, error) {
	o, err := taskOptions(tf.repos, tf.envs, nil)
	if err != nil {
		return nil, &exitError{Code: 2, Err: err}
	}
	ts, problems, err := task.Load(tf.spec, o)
	if err != nil {
		return nil, &exitError{Code: 2, Err: err}
	}
	for _, p := range problems {
		fmt.Fprintf(cmd.ErrOrStderr(), "not loaded: %v\n", p)
	}
	switch {
	case len(ts) == 0:
		return nil, &exitError{Code: 2, Err: fmt.Errorf("tasks %s: no task could be loaded (%d failed; the reasons are above)", tf.spec, len(problems))}
	case tf.strict && len(problems) > 0:
		return nil, &exitError{Code: 2, Err: fmt.Errorf("tasks %s: %d tasks failed to load (--strict; the reasons are above)", tf.spec, len(problems))}
	}
	return ts, nil
}

// ls is tasks ls.
func (tf *tasksFlags) ls(cmd *cobra.Command, _ []string) error {
	ts, err := tf.load(cmd)
	if err != nil {
		return err
	}
	out := cmd.OutOrStdout()
	if tf.asJSON {
		type row struct {
			*task.Task
			Solution bool `json:"has_solution"`
		}
		rows := make([]row, len(ts))
		for i, t := range ts {
			rows[i] = row{t, t.Solution != nil}
		}
		return writeJSON(out, rows)
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tLANGUAGE\tF2P\tP2P\tSOLUTION\tTITLE")
	for _, t := range ts {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%s\t%s\n", t.ID, t.Language, len(t.FailToPass), len(t.PassToPass), yesNo(t.Solution != nil), t.Title)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(out, "%d tasks\n", len(ts))
	return nil
}

// show is tasks show.
func (tf *tasksFlags) show(cmd *cobra.Command, args []string) error {
	ts, err := tf.load(cmd)
	if err != nil {
		return err
	}
	t, err := task.Lookup(ts, args[0])
	if err != nil {
		return &exitError{Code: 2, Err: err}
	}
	out := cmd.OutOrStdout()
	if tf.asJSON {
		return writeJSON(out, t)
	}
	fmt.Fprintf(out, "%s (%s): %s\n\n%s\n\ntests:   %s  (parser %s)\nbudget:  %s\nF2P:     %v\nP2P:     %v\ntest files (restored at verify): %v\n",
		t.ID, t.Language, t.Title, t.Statement, t.TestCmd, t.Parser, t.Budget(), t.FailToPass, t.PassToPass, t.TestFiles)
	if t.Solution != nil {
		if len(t.Solution.Files) > 0 {
			fmt.Fprintf(out, "solution: writes %v\n", t.Solution.Paths())
		} else {
			fmt.Fprintln(out, "solution: a patch")
		}
	}
	return nil
}

const tasksLong = `tasks lists the repository tasks an episode can work on.

--tasks says where they come from: builtin (the default: small repositories
in Go, Python, JavaScript and shell shipped in stasis, each with a real
bug, tests that fail before the fix and pass after, and a reference
solution), a task directory (task.json, repo/, solution/), a directory of
them, or a SWE-bench JSONL file whose instances are loaded from the git
repositories under --repos (clones or git bundles named OWNER__NAME). A
SWE-bench task's work tree is the repository at base_commit without
test_patch; verify restores the files test_patch touches and runs the
command SWE-bench's harness runs for the repository.

Tasks that cannot be loaded are listed with the reason, on stderr. ls exits
2 when a file given with --tasks loads no task at all, and with --strict
when any task fails to load.`

const tasksExample = `  stasis tasks ls
  stasis tasks show go-lru-get-recency
  stasis tasks ls --tasks swe.jsonl --repos ~/clones --json`

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

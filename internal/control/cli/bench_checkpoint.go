package cli

import (
	"fmt"
	"os"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"stasis/internal/control/bench"
)

func newBenchCheckpointCmd() *cobra.Command {
	var (
		sizes       []int
		concurrency int
		asJSON      bool
	)
	cmd := &cobra.Command{
		Use:   "checkpoint [--sizes 16,64,256] [--concurrency N] [--json]",
		Short: "Checkpoint and restore of N concurrent mini episodes on the local provider",
		Long: `checkpoint starts N mini-harness episodes of the built-in Python, shell and
JavaScript tasks on the local provider (in a temporary state directory,
removed afterwards), holds each at its third model call, takes a checkpoint
(pause, snapshot and record every episode with bounded concurrency, commit,
continue), then loses every sandbox as a crash would and restores the
checkpoint (validate, fork, relaunch). It prints seconds per phase, the
snapshots' size and what the blob store holds, and the peak memory of this
process.

Targets on a 2-core machine: 256 episodes checkpointed in <= 10 s and
restored in <= 15 s.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			exe, err := os.Executable()
			if err != nil {
				return err
			}
			rs, runErr := bench.Checkpoint(cmd.Context(), bench.CheckpointOptions{Exe: exe, Sizes: sizes, Concurrency: concurrency, Progress: cmd.ErrOrStderr()})
			// The sizes measured before one failed are printed, then the
			// failure.
			if runErr != nil && len(rs) == 0 {
				return runErr
			}
			out := cmd.OutOrStdout()
			if asJSON {
				if err := writeJSON(out, rs); err != nil {
					return err
				}
				return runErr
			}
			tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', tabwriter.AlignRight)
			fmt.Fprintln(tw, "EPISODES\tCHECKPOINT s\t(prepare\tcommit\tcontinue)\tPAUSE p50/max s\tSNAPSHOT p50/max s\tRESTORE s\t(validate\tfork\tresume)\tSNAPSHOTS MiB\tSTORED MiB\tPEAK RSS MiB\t")
			for _, r := range rs {
				fmt.Fprintf(tw, "%d\t%.2f\t%.2f\t%.3f\t%.2f\t%.2f/%.2f\t%.2f/%.2f\t%.2f\t%.3f\t%.2f\t%.2f\t%.0f\t%.0f\t%.0f\t\n",
					r.Episodes, r.CheckS, r.PrepareS, r.CommitS, r.ContinueS, r.PauseP50S, r.PauseMaxS, r.SnapshotP50S, r.SnapshotMaxS,
					r.RestoreS, r.ValidateS, r.ForkS, r.ResumeS, float64(r.Bytes)/(1<<20), float64(r.Stored)/(1<<20), float64(r.PeakRSSKiB)/1024)
			}
			_ = tw.Flush()
			for _, r := range rs {
				if r.Episodes == 256 {
					verdict(out, "256 episodes checkpointed", time.Duration(r.CheckS*float64(time.Second)), 10*time.Second)
					verdict(out, "256 episodes restored", time.Duration(r.RestoreS*float64(time.Second)), 15*time.Second)
				}
			}
			return runErr
		},
	}
	cmd.Flags().IntSliceVar(&sizes, "sizes", []int{16, 64, 256}, "episode counts to measure")
	cmd.Flags().IntVar(&concurrency, "concurrency", 256, "episodes the coordinator works on at once")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

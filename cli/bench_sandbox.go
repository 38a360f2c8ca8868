package cli

import (
	"encoding/json"
	"fmt"
	"os"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"stasis/bench"
)

func newBenchSandboxCmd() *cobra.Command {
	var (
		n      int
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "sandbox [--n N] [--json]",
		Short: "Local sandbox create-to-first-exec latency, beside bubblewrap alone",
		Long: `sandbox creates N local sandboxes one after another (in a temporary state
directory, removed afterwards) and times each from the start of create to
the end of its first exec of "true". The baseline, measured in the same run,
is bubblewrap running "true" in fresh namespaces as a single process.

Target: create-to-first-exec p50 <= 50 ms.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			exe, err := os.Executable()
			if err != nil {
				return err
			}
			r, err := bench.SandboxStart(cmd.Context(), bench.SandboxStartOptions{Exe: exe, N: n, Progress: cmd.ErrOrStderr()})
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if asJSON {
				b, _ := json.MarshalIndent(r, "", "  ")
				fmt.Fprintln(out, string(b))
				return nil
			}
			tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', tabwriter.AlignRight)
			fmt.Fprintln(tw, "MEASURE\tP50 ms\tP99 ms\tMAX ms\t")
			for _, row := range []struct {
				name string
				l    bench.Latency
			}{{"create → first exec", r.CreateExec}, {"  create", r.Create}, {"  first exec", r.FirstExec}, {"baseline: bwrap true", r.Bwrap}} {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t\n", row.name, ms(row.l.P50), ms(row.l.P99), ms(row.l.Max))
			}
			tw.Flush()
			fmt.Fprintf(out, "\n%d sandboxes; create-to-first-exec p50 is %.1f× bubblewrap alone\n", r.N, float64(r.CreateExec.P50)/float64(r.Bwrap.P50))
			verdict(out, "create-to-first-exec p50", r.CreateExec.P50, 50*time.Millisecond)
			return nil
		},
	}
	cmd.Flags().IntVar(&n, "n", 50, "sandboxes to time")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

package cli

import (
	"fmt"
	"io"
	"os"
	"text/tabwriter"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/spf13/cobra"

	"stasis/internal/control/bench"
)

func newBenchSandboxCmd() *cobra.Command {
	var (
		n      int
		asJSON bool
		img    string
	)
	cmd := &cobra.Command{
		Use:   "sandbox [--n N] [--json]",
		Short: "Local sandbox create-to-first-exec latency, beside bubblewrap alone",
		Long: `sandbox creates N local sandboxes one after another (in a temporary state
directory, removed afterwards) and times each from the start of create to
the end of its first exec of "true". The baseline, measured in the same run,
is bubblewrap running "true" in fresh namespaces as a single process.

With --image REF the same is timed on that image in every round (after
one pull, whose unpack is reported), against the host-root sandboxes of
the same run. Target: at most 1.5x the host-root mode.

Target: create-to-first-exec p50 <= 50 ms.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			exe, err := os.Executable()
			if err != nil {
				return err
			}
			r, err := bench.SandboxStart(cmd.Context(), bench.SandboxStartOptions{Exe: exe, N: n, Image: img, Progress: cmd.ErrOrStderr()})
			if err != nil {
				return err
			}
			return printBench(cmd.OutOrStdout(), asJSON, r, printSandboxBench)
		},
	}
	cmd.Flags().IntVar(&n, "n", 50, "sandboxes to time")
	cmd.Flags().StringVar(&img, "image", "", "also time sandboxes on this image (see stasis image --help)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func printSandboxBench(out io.Writer, r bench.SandboxStartResult) error {
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
	if r.ImageCreateExec != nil {
		u := r.Unpack
		fmt.Fprintf(out, "\nimage %s: unpacked %s in %d files in %.1fs\n", shortDigest(u.Digest), humanize.IBytes(uint64(u.Bytes)), u.Files, u.Seconds)
		fmt.Fprintf(out, "on the image: create-to-first-exec p50 %s ms, p99 %s ms: %.2f× the host-root mode\n", ms(r.ImageCreateExec.P50), ms(r.ImageCreateExec.P99), r.ImageRatio)
		mark := "meets"
		if r.ImageRatio > 1.5 {
			mark = "MISSES"
		}
		fmt.Fprintf(out, "image/host-root p50 %.2f× %s the 1.5× target\n", r.ImageRatio, mark)
	}
	return nil
}

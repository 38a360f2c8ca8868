package cli

import (
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"stasis/internal/control/bench"
)

func newBenchSnapshotCmd() *cobra.Command {
	var (
		treeMiB int
		changed float64
		dir     string
		asJSON  bool
	)
	cmd := &cobra.Command{
		Use:   "snapshot",
		Short: "Cost of file-only snapshots (content-addressed, incremental) against cp -a and tar",
		Long: `snapshot generates a tree of incompressible files (a few thousand files of
mixed sizes in nested directories), stores it in a fresh content-addressed
blob store, changes a share of its bytes and stores it again with the first
snapshot as the previous one. It reports:

  snapshot (first)        time and bytes written to the blob store
  snapshot (incremental)  the same after the change: only changed files are
                          read and only their new chunks written
  cp -a, tar -cf          the same changed tree copied and archived by the real
                          commands, in the same run: the baselines
  restore (fork)          materialising the incremental snapshot into a new tree

Every step starts on a synced file system; snapshots fsync what they write,
the baselines do not. Target: after a 1% change the incremental snapshot is at
least 10x cheaper than cp -a, in time and in bytes written. Everything the
benchmark writes is removed at the end.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if treeMiB < 1 {
				return &exitError{Code: 2, Err: fmt.Errorf("--tree-mib %d: give a size of at least 1 MiB", treeMiB)}
			}
			if changed <= 0 || changed > 100 {
				return &exitError{Code: 2, Err: fmt.Errorf("--changed-percent %g: give a share above 0 and at most 100", changed)}
			}
			res, err := bench.Snapshot(cmd.Context(), bench.SnapshotOptions{
				Dir: dir, TreeMiB: treeMiB, ChangedPercent: changed, Progress: cmd.ErrOrStderr(),
			})
			if err != nil {
				return err
			}
			return printBench(cmd.OutOrStdout(), asJSON, res, printSnapshotBench)
		},
	}
	f := cmd.Flags()
	f.IntVar(&treeMiB, "tree-mib", 200, "size of the generated tree, in MiB")
	f.Float64Var(&changed, "changed-percent", 1, "share of the tree's bytes changed before the incremental snapshot")
	f.StringVar(&dir, "dir", "", "scratch directory (default: the system's temporary directory); its file system is what is measured, and it needs about 5x the tree's size free")
	f.BoolVar(&asJSON, "json", false, "print the results as JSON")
	return cmd
}

func snapshotMiB(n int64) string { return fmt.Sprintf("%.2f", float64(n)/(1<<20)) }

func printSnapshotBench(out io.Writer, r bench.SnapshotResult) error {
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "WHAT\tTIME ms\tWRITTEN MiB\tDIR GROWTH MiB\tREAD MiB\tNEW BLOBS\tREUSED FILES\t")
	for _, row := range r.Rows {
		blobs, reused := "-", "-"
		if row.NewBlobs > 0 || row.ReusedFiles > 0 {
			blobs, reused = fmt.Sprint(row.NewBlobs), fmt.Sprint(row.ReusedFiles)
		}
		read := "-"
		if row.ReadBytes > 0 {
			read = snapshotMiB(row.ReadBytes)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n", row.What, ms(row.Duration), snapshotMiB(row.BytesWritten),
			snapshotMiB(row.DirGrowth), read, blobs, reused)
	}
	tw.Flush()
	fmt.Fprintln(out)
	fmt.Fprintf(out, "tree: %s MiB in %d files and %d directories; changed %g%% of its bytes: %d files, %s MiB written\n",
		snapshotMiB(r.TreeBytes), r.Files, r.Dirs, r.ChangedPercent, r.ChangedFiles, snapshotMiB(r.ChangedBytes))
	fmt.Fprintf(out, "cp -a over incremental snapshot:   %.1fx time, %.1fx bytes\n", r.CpTimeRatio, r.CpBytesRatio)
	fmt.Fprintf(out, "tar -cf over incremental snapshot: %.1fx time, %.1fx bytes\n", r.TarTimeRatio, r.TarBytesRatio)
	mark := "meets"
	if !r.MeetsTarget {
		mark = "MISSES"
	}
	fmt.Fprintf(out, "incremental snapshot %.1fx cheaper than cp -a in time, %.1fx in bytes: %s the %gx target\n",
		r.CpTimeRatio, r.CpBytesRatio, mark, r.Target)
	return nil
}

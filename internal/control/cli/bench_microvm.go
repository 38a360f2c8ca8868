package cli

import (
	"fmt"
	"io"
	"os"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"stasis/internal/control/bench"
)

func newBenchMicroVMCmd() *cobra.Command {
	var (
		mem         []int
		fill        float64
		guestBinary string
		asJSON      bool
	)
	cmd := &cobra.Command{
		Use:   "microvm [--mem 128,256,512] [--fill 0.25] [--json]",
		Short: "microVM snapshot and restore against dd, cold boot against restore, fork of 4",
		Long: `microvm boots one guest per size (in a temporary state directory, removed
afterwards), fills --fill of its memory with random data in its RAM file
system, and measures:

  cold boot    create to the end of the first exec
  snapshot     the first snapshot of the VM: stop, QEMU's migration written
               into a pack file of the content-addressed store and staged
               as it is written (cut by guest address, hashed,
               deduplicated), continue, made durable; beside dd
               writing as many bytes as it stored, with conv=fsync, on the
               same file system, right after it. PAUSED is how long the
               guest was stopped.
  2nd snapshot the bytes a second snapshot of the same VM adds to the store
  restore      fork of 1 to the end of its first exec, the source deleted;
               beside dd reading the bytes back
  fork of 4    fork of 4 to the end of the first exec in each

Cold boots, first snapshots (each of a new VM, from an empty store) and
restores are medians of three; SNAP/DD is the median of the three ratios.

It says whether KVM or TCG ran the guests. Targets: snapshot <= 1.5x the dd
write; restore to first exec <= 1/3 of cold boot to first exec; a second
snapshot stores <= 25% of the first.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			exe, err := os.Executable()
			if err != nil {
				return err
			}
			r, err := bench.MicroVM(cmd.Context(), bench.MicroVMOptions{Exe: exe, GuestBinary: guestBinary, Mem: mem, Fill: fill, Progress: cmd.ErrOrStderr()})
			if err != nil {
				return err
			}
			return printBench(cmd.OutOrStdout(), asJSON, r, printMicroVMBench)
		},
	}
	cmd.Flags().IntSliceVar(&mem, "mem", []int{128, 256, 512}, "guest memory sizes, MiB")
	cmd.Flags().Float64Var(&fill, "fill", 0.25, "share of guest memory filled with random data before the snapshot")
	cmd.Flags().StringVar(&guestBinary, "guest-binary", "", "the static stasis for the guest image (default: this binary)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func printMicroVMBench(out io.Writer, r bench.MicroVMResult) error {
	fmt.Fprintf(out, "accelerator %s (%s); kernel %s\n\n", r.Accel, r.Reason, r.Kernel)
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "MEM MiB\tSTATE MB\tSTORED MB\tSNAPSHOT ms\tPAUSED ms\tDD WRITE ms\tSNAP/DD\tRESTORE ms\tDD READ ms\tCOLD BOOT ms\tRESTORE/BOOT\tFORK 4 ms\t2ND SNAP MB\t2ND/1ST\t")
	worst := struct{ snap, restore, second float64 }{}
	for _, row := range r.Rows {
		rb := float64(row.Restore) / float64(row.ColdBoot)
		second := float64(row.SecondNewBytes) / float64(row.NewBytes)
		worst.snap, worst.restore, worst.second = max(worst.snap, row.SnapshotOverDD), max(worst.restore, rb), max(worst.second, second)
		fmt.Fprintf(tw, "%d\t%.1f\t%.1f\t%s\t%s\t%s\t%.2f\t%s\t%s\t%s\t%.2f\t%s\t%.1f\t%.2f\t\n", row.MemMiB, float64(row.StateBytes)/1e6, float64(row.NewBytes)/1e6,
			ms(row.Snapshot), ms(row.Paused), ms(row.DDWrite), row.SnapshotOverDD, ms(row.Restore), ms(row.DDRead), ms(row.ColdBoot), rb, ms(row.Fork4),
			float64(row.SecondNewBytes)/1e6, second)
	}
	tw.Flush()
	fmt.Fprintln(out)
	if len(r.Rows) > 0 {
		fmt.Fprintf(out, "the state was cut %s\n", r.Rows[len(r.Rows)-1].Cut)
	}
	ratio(out, "snapshot, stored content-addressed / dd write (worst)", worst.snap, 1.5)
	ratio(out, "restore / cold boot, to first exec (worst)", worst.restore, 1.0/3)
	ratio(out, "second snapshot / first (worst)", worst.second, 0.25)
	return nil
}

func ratio(out io.Writer, what string, got, target float64) {
	mark := "meets"
	if got > target {
		mark = "MISSES"
	}
	fmt.Fprintf(out, "%s %.2f %s the %.2f target\n", what, got, mark, target)
}

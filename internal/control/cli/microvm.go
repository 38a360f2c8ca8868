package cli

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"stasis/internal/control/home"
	"stasis/internal/control/task"
	"stasis/internal/insandbox/sandboxcli"
	"stasis/internal/providers/microvm"
)

// newMicroVMCmd holds the commands the microVM provider runs itself: the
// keeper on the host, the gateway pipe QEMU starts per guest connection,
// and the agent inside the guest.
func newMicroVMCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:    "microvm",
		Short:  "Processes of the microVM provider (keeper, pipe, guest agent)",
		Hidden: true,
	}
	keeper := newKeeperCmd("Hold one microVM's QEMU and enforce its expiry (started by create and fork)", "microvm-keeper", microvm.RunKeeper)

	var sock string
	pipe := &cobra.Command{
		Use:   "pipe --unix SOCKET",
		Short: "Join stdin and stdout to a unix socket (QEMU runs it per guest connection to the gateway)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := net.Dial("unix", sock)
			if err != nil {
				return err
			}
			defer c.Close()
			done := make(chan struct{})
			go func() {
				_, _ = io.Copy(c, os.Stdin)
				if uc, ok := c.(*net.UnixConn); ok {
					_ = uc.CloseWrite()
				}
			}()
			go func() {
				_, _ = io.Copy(os.Stdout, c)
				close(done)
			}()
			<-done
			return nil
		},
	}
	pipe.Flags().StringVar(&sock, "unix", "", "the unix socket to join")

	agentCmd := sandboxcli.NewGuestAgentCmd()
	var blobs, manifest string
	state := &cobra.Command{
		Use:   "state --blobs DIR --manifest ID",
		Short: "Write a saved VM state to stdout, streamed out of the blob store (QEMU runs it for a fork's incoming migration)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			w := bufio.NewWriterSize(os.Stdout, 1<<20)
			if err := microvm.CatState(cmd.Context(), blobs, manifest, w); err != nil {
				return err
			}
			return w.Flush()
		},
	}
	state.Flags().StringVar(&blobs, "blobs", "", "the provider's blob store")
	state.Flags().StringVar(&manifest, "manifest", "", "the snapshot's manifest")
	cmd.AddCommand(keeper, pipe, agentCmd, state)
	return cmd
}

func newSandboxDoctorCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "doctor",
		Short: "Check what the microVM provider needs: QEMU, the kernel, busybox, a static stasis, the accelerator",
		Long: `doctor checks what the microVM provider needs and prints one line per check,
with the command that fixes each failed one: QEMU (qemu-system-x86), the
Debian cloud kernel unpacked in $STASIS_MICROVM_KERNEL (make deps-microvm),
a static busybox (busybox-static) and a static stasis for the guest
(CGO_ENABLED=0, as make build does). When all is there it builds the guest
image and says which accelerator is used: KVM when a probe boot under KVM
works, TCG (software emulation) otherwise; the answer is cached beside the
kernel. Exit status 1 when something is missing.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			h, err := home.Dir()
			if err != nil {
				return err
			}
			r := microvm.Doctor(cmd.Context(), microvm.Options{Home: h})
			if ts, err := task.Builtin(); err == nil {
				for _, t := range ts {
					if microvm.CanRun(t.Language, t.Image) {
						r.Tasks = append(r.Tasks, t.ID)
					}
				}
			}
			if asJSON {
				if err := writeJSON(cmd.OutOrStdout(), r); err != nil {
					return err
				}
			} else {
				tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
				for _, c := range r.Checks {
					mark := "ok"
					if !c.OK {
						mark = "MISSING"
					}
					fmt.Fprintf(tw, "%s\t%s\t%s\n", c.Name, mark, c.Detail)
					if c.Fix != "" {
						fmt.Fprintf(tw, "\t\tfix: %s\n", c.Fix)
					}
				}
				_ = tw.Flush()
				fmt.Fprintf(cmd.OutOrStdout(), "the guest has busybox and stasis: of the built-in tasks it runs the shell ones (%s), with the mini harness\n", strings.Join(r.Tasks, ", "))
				if r.Ready {
					fmt.Fprintf(cmd.OutOrStdout(), "microvm provider ready (%s)\n", r.Accel)
				}
			}
			if !r.Ready {
				return &exitError{Code: 1, Err: errors.New("the microvm provider is not ready: see the fixes above")}
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the report as JSON")
	return cmd
}

package sandboxcli

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/spf13/cobra"

	"stasis/internal/guestclock"
)

func newClockCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "clock",
		Short: "Set this sandbox's wall clock after a restore (run by the host through the provider's exec)",
		Long: `clock sets the sandbox's wall clock after a restore that kept its processes.
The host runs it through the provider's exec API; the target is computed
here, from this sandbox's own uptime (CLOCK_BOOTTIME, what /proc/uptime
shows and what the supervisor's acknowledgements record), a few
microseconds before the clock is set, so the exec API's latency does not
move where the clock lands.`,
		Hidden: true,
	}
	var pauseWall, pauseUptime, wall float64
	set := &cobra.Command{
		Use:   "set (--pause-wall W --pause-uptime U | --wall T)",
		Short: "Set the wall clock and print what was done, as JSON",
		Long: `set sets the wall clock (CLOCK_REALTIME) and prints {"uptime","before","after"}.

  --pause-wall W --pause-uptime U   the continuous policy: W + (uptime now − U),
                                    as if no time had passed outside the sandbox
  --wall T                          unix seconds T (the host policy)

It needs the right to set the time (CAP_SYS_TIME): root in a VM guest. Exit
status 1 when the clock could not be set, 2 for a usage error.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			fl := cmd.Flags()
			cont := fl.Changed("pause-wall") || fl.Changed("pause-uptime")
			if cont == fl.Changed("wall") || (cont && !(fl.Changed("pause-wall") && fl.Changed("pause-uptime"))) {
				return &exitError{Code: 2, Err: errors.New("clock set: give --pause-wall and --pause-uptime, or --wall")}
			}
			t := guestclock.Target{Continuous: cont, PauseWall: pauseWall, PauseUptime: pauseUptime, Wall: wall}
			if err := t.Check(); err != nil {
				return &exitError{Code: 2, Err: fmt.Errorf("clock set: %w", err)}
			}
			f, err := guestclock.System.Set(t)
			if err != nil {
				return &exitError{Code: 1, Err: fmt.Errorf("clock set: %w", err)}
			}
			b, _ := json.Marshal(f)
			fmt.Fprintf(cmd.OutOrStdout(), "%s\n", b)
			return nil
		},
	}
	set.Flags().Float64Var(&pauseWall, "pause-wall", 0, "the wall clock at the pause (unix seconds)")
	set.Flags().Float64Var(&pauseUptime, "pause-uptime", 0, "the uptime at the pause (seconds)")
	set.Flags().Float64Var(&wall, "wall", 0, "the wall clock to set (unix seconds)")
	cmd.AddCommand(set)
	return cmd
}

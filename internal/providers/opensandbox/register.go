package opensandbox

import "stasis/sandbox"

func init() {
	sandbox.Register(Name, sandbox.HostedDriver(FromEnv))
}

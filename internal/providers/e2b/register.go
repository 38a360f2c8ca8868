package e2b

import "stasis/sandbox"

func init() {
	sandbox.Register(Name, sandbox.HostedDriver(func() (*Provider, error) { return New(FromEnv()) }))
}

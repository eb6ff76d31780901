"""meshfold: fold transformer training onto a device mesh along every parallel dimension."""

__version__ = "0.1.0"
